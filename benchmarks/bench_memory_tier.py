#!/usr/bin/env python
"""The memory tier (issue 20), by hand: per-step checkpointing overhead, and recovery after a node loss.

    python benchmarks/bench_memory_tier.py overhead --state-mib 128 --steps 60 --step-ms 50
    python benchmarks/bench_memory_tier.py recovery --state-mib 64
    python benchmarks/bench_memory_tier.py all          # both, one markdown table each

(a) ``overhead``: one process; a compute loop (matmuls calibrated to ``--step-ms`` per step) whose state
(``--state-mib`` of fp32 tensors) changes every step (an in-place update of every tensor, as an optimizer step
does), run without checkpointing and saving every step to the memory tier (``Store.save(blocking=False)``,
memory root under /dev/shm, no replicas, disk promotion off). Reported: throughput ratio (steps/s with saves
over steps/s without; the no-checkpoint run is done before and after, its mean is the reference), the stall
(time inside ``save``) p50/p99, and the step time p50/p99 of both runs.

(b) ``recovery``: 4 ranks as 2 nodes (node_size=2, gloo on 127.0.0.1, launched like torchrun), each rank's state
``--state-mib`` of data-parallel model bytes (the same on every rank) + 1 MiB of its own. One job saves step 1
to memory (replicated to the peer node), to disk and to the remote (moto on 127.0.0.1, behind a byte-counting
proxy). Node 1 is lost (its memory and disk roots removed) and the job restarts twice: from peers (memory roots
of node 0 intact) and from the remote (both memory roots gone too). Reported: resume seconds (slowest rank,
from ``Store(...)`` to ``resume`` returning; process start-up excluded), bytes moved between peers
(``resumed_from["peer_bytes"]``) and bytes answered by the object store.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402

MiB = 1 << 20


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# -- (a) overhead -------------------------------------------------------------------------------------------------
def make_state(mib: int, n: int = 8):
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(mib * MiB // 4 // n, generator=g) for i in range(n)}


def calibrate(step_ms: float):
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t0, k = time.perf_counter(), 20
    for _ in range(k):
        a @ b
    per = (time.perf_counter() - t0) / k
    return a, b, max(1, round(step_ms / 1000 / per))


def loop(state, steps, a, b, iters, store=None, warmup=5):
    step_s, stall_s = [], []
    for step in range(1, steps + warmup + 1):
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        for t in state.values():
            t.add_(1e-3)                                # every byte changes, as in an optimizer step
        ts = time.perf_counter()
        if store is not None:
            store.save(state, step, blocking=False)
        t1 = time.perf_counter()
        if step > warmup:
            step_s.append(t1 - t0)
            stall_s.append(t1 - ts)
    if store is not None:
        store.wait()
    return step_s, stall_s


def overhead(args) -> str:
    from ckptstore import Memory, Store
    a, b, iters = calibrate(args.step_ms)
    state = make_state(args.state_mib)
    base1, _ = loop(state, args.steps, a, b, iters)
    mem = tempfile.mkdtemp(prefix="ckptstore-bench-mem-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="ckptstore-bench-disk-")
    try:
        with Store(disk, memory=Memory(mem, every=1, disk_every=10 ** 9, capacity=4 * args.state_mib * MiB,
                                       keep=2, replicas=0)) as store:
            ck, stall = loop(state, args.steps, a, b, iters, store)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    base2, _ = loop(state, args.steps, a, b, iters)
    base = base1 + base2
    ratio = (len(ck) / sum(ck)) / (len(base) / sum(base))
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    return "\n".join([
        f"(a) per-step save to the memory tier, {args.state_mib} MiB of state changing every step, "
        f"compute ~{args.step_ms:.0f} ms/step ({iters} matmuls 512x512, torch threads {torch.get_num_threads()}), "
        f"{args.steps} steps after 5 warm-up, {os.cpu_count()} cores",
        "",
        "| run | steps/s | throughput vs none | step p50 ms | step p99 ms | stall in save p50 ms | stall p99 ms |",
        "|---|---|---|---|---|---|---|",
        f"| no checkpointing | {len(base) / sum(base):.2f} | 1.000 | {ms(pct(base, 50))} | "
        f"{ms(pct(base, 99))} | - | - |",
        f"| memory tier every step | {len(ck) / sum(ck):.2f} | {ratio:.3f} | {ms(pct(ck, 50))} | "
        f"{ms(pct(ck, 99))} | {ms(pct(stall, 50))} | {ms(pct(stall, 99))} |",
    ])


# -- (b) recovery -------------------------------------------------------------------------------------------------
class ByteProxy:
    """tests/countproxy.CountingProxy that also counts the bytes the object store answered with."""

    def __new__(cls, upstream_port):
        from countproxy import CountingProxy

        class _P(CountingProxy):
            down_bytes = 0

            async def _handle(self, cr, cw):
                up = down = None
                try:
                    ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)

                    async def pipe():
                        while True:
                            data = await ur.read(65536)
                            if not data:
                                break
                            type(self).down_bytes += len(data)
                            cw.write(data)
                            await cw.drain()
                    down = asyncio.ensure_future(pipe())
                    up = asyncio.ensure_future(self._requests(cr, uw, cw))
                    await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
                except (ConnectionError, OSError):
                    pass
                finally:
                    for t in (up, down):
                        if t is not None:
                            t.cancel()
                    cw.close()
        return _P(upstream_port)


def worker(args) -> None:
    import torch.distributed as dist
    from ckptstore import Memory, Remote, Store
    from dist_worker import finish
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // 2
    g = torch.Generator().manual_seed(0)
    n = args.state_mib * MiB // 4 // 8
    state = {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)},
             "own": torch.randn(MiB // 4, generator=torch.Generator().manual_seed(1 + rank)), "step": 0}
    t0 = time.perf_counter()
    store = Store(f"{args.base}/disk{node}", rank=rank, world_size=world,
                  remote=Remote(args.remote, every=1), storage_options=json.loads(args.so), collective_timeout=300,
                  memory=Memory(f"{args.shm}/mem{node}", every=1, disk_every=1, capacity=8 * args.state_mib * MiB,
                                keep=2, replicas=1, node_size=2, timeout=120.0))
    out = {"rank": rank}
    if args.worker == "save":
        store.save(state, 1)
        store.wait()
        store.wait_for_uploads(600)
    else:
        fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                 "own": torch.zeros_like(state["own"]), "step": 0}
        got = store.resume(fresh)
        out["resume_s"] = time.perf_counter() - t0
        out["resumed"] = got
        out["resumed_from"] = store.resumed_from
        assert got == 1 and all(torch.equal(fresh["model"][k], state["model"][k]) for k in state["model"])
        assert torch.equal(fresh["own"], state["own"]), rank
    dist.barrier()
    store.close()
    print("RESULT " + json.dumps(out), flush=True)
    finish()


def lost_unique_bytes(root: Path, step: int, ranks) -> int:
    """Raw bytes of the distinct chunks (by id) of ``ranks``' manifests of ``step`` in the store root ``root``."""
    from ckptstore.manifest import decode_manifest
    seen = {}
    for r in ranks:
        p = root / "steps" / f"{step:012d}" / f"manifest-rank{r:05d}.msgpack"
        for ch in decode_manifest(p.read_bytes(), step=step, rank=r, what=str(p)).chunk_refs():
            seen[ch.blob_id] = ch.nbytes
    return sum(seen.values())


def recovery(args) -> str:
    from backends.launcher import S3Server
    from dist import Job
    script = Path(__file__).resolve()
    base = Path(tempfile.mkdtemp(prefix="ckptstore-bench-rec-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptstore-bench-rec-", dir="/dev/shm"))
    rows = []
    try:
        with S3Server() as server:
            proxy = ByteProxy(server.port)
            with proxy:
                url = server.new_bucket_url()
                so = json.dumps(dict(server.storage_options(), endpoint_url=proxy.endpoint))
                common = ["--base", str(base), "--shm", str(shm), "--remote", f"{url}/run", "--so", so,
                          "--state-mib", str(args.state_mib)]
                Job(4, "--worker", "save", *common, script=script).check(900)
                unique = lost_unique_bytes(shm / "mem0", 1, (2, 3))

                def lose(paths):
                    for p in paths:
                        shutil.rmtree(p, ignore_errors=True)

                for name, gone in (("peers' memory", [shm / "mem1", base / "disk1"]),
                                   ("remote (S3, moto)", [shm / "mem0", shm / "mem1", base / "disk1"])):
                    lose(gone)
                    proxy.reset()
                    b0 = type(proxy).down_bytes
                    t0 = time.perf_counter()
                    res = Job(4, "--worker", "resume", *common, script=script).check(900)
                    wall = time.perf_counter() - t0
                    s3_bytes = type(proxy).down_bytes - b0
                    gets = proxy.counts["GET"]
                    slow = max(r["resume_s"] for r in res.values())
                    tiers = sorted({f'{r["resumed_from"]["tier"]}' for r in res.values()})
                    peer = sum(r["resumed_from"].get("peer_bytes", 0) or 0 for r in res.values())
                    rows.append(f"| {name} | {'/'.join(tiers)} | {slow:.2f} | {wall:.1f} | {unique / MiB:.1f} | "
                                f"{peer / MiB:.1f} | {s3_bytes / MiB:.1f} | {gets} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return "\n".join([
        f"(b) recovery after the loss of node 1 (ranks 2, 3) of 4 ranks as 2 nodes; per rank {args.state_mib} MiB "
        f"of data-parallel model bytes + 1 MiB of its own; {os.cpu_count()} cores",
        "",
        "| recovered from | tiers (all ranks) | resume s (slowest rank) | job wall s | lost node's unique MiB | "
        "MiB from peers | MiB answered by S3 | S3 GETs (whole job) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", nargs="?", default="all", choices=["overhead", "recovery", "all"])
    ap.add_argument("--state-mib", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-ms", type=float, default=50)
    ap.add_argument("--worker", choices=["save", "resume"])
    ap.add_argument("--base")
    ap.add_argument("--shm")
    ap.add_argument("--remote")
    ap.add_argument("--so")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = []
    if args.section in ("overhead", "all"):
        out.append(overhead(args))
    if args.section in ("recovery", "all"):
        out.append(recovery(args))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
