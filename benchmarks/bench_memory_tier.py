#!/usr/bin/env python
"""The memory tier (issue 20), by hand: per-step checkpointing overhead, and recovery after a node loss.

    python benchmarks/bench_memory_tier.py overhead --state-mib 128 --steps 60 --step-ms 50
    python benchmarks/bench_memory_tier.py recovery --state-mib 64
    python benchmarks/bench_memory_tier.py all          # both, one markdown table each

(a) ``overhead``: one process; a compute loop (matmuls calibrated to ``--step-ms`` per step) whose state
(``--state-mib`` of fp32 tensors) changes every step (an in-place update of every tensor, as an optimizer step
does), run without checkpointing and saving every step to the memory tier (``Store.save(blocking=False)``,
memory root under /dev/shm, no replicas, disk promotion off): contenders alternated, the no-checkpoint run
before and after (``--repeat``: more rounds). Reported: throughput ratio (steps/s with saves over steps/s
without, every step of the runs pooled), the stall (time inside ``save``) p50/p99, and the step time p50/p99
of both.

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
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)
import torch  # noqa: E402
import common as C  # noqa: E402
from countproxy import CountingProxy  # noqa: E402

MiB = 1 << 20
NONE, MEMORY = "no checkpointing", "memory tier every step"


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


def loop(state, steps, a, b, iters, store=None, warmup=5) -> dict:
    """``steps`` steps (after ``warmup``) of compute + an in-place change of every tensor, saving every step to
    ``store`` (non-blocking) when given: the step times and the stalls (time inside ``save``)."""
    step_s, stall_s = [], []
    for step in range(1, steps + warmup + 1):
        if step == warmup + 1:
            cpu0 = sum(os.times()[:2])
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
    cpu = (sum(os.times()[:2]) - cpu0) / len(step_s)   # the process's CPU seconds (every thread) per step
    return {"seconds": sum(step_s), "steps": step_s, "stalls": stall_s, "rate": len(step_s) / sum(step_s), "cpu": cpu}


def measure(state_mib: int, step_ms: float, steps: int, repeat: int, progress: bool = True) -> H.Results:
    """No checkpointing (before and after) vs the memory tier every step, alternated ``repeat`` times."""
    from ckptstore import Memory, Store
    a, b, iters = calibrate(step_ms)
    state = make_state(state_mib)

    def memory_tier():
        mem = tempfile.mkdtemp(prefix="ckptstore-bench-mem-", dir="/dev/shm")
        disk = tempfile.mkdtemp(prefix="ckptstore-bench-disk-")
        try:
            with Store(disk, memory=Memory(mem, every=1, disk_every=10 ** 9, capacity=4 * state_mib * MiB,
                                           keep=2, replicas=0)) as store:
                return loop(state, steps, a, b, iters, store)
        finally:
            shutil.rmtree(mem, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    none = H.Contender(NONE, lambda: loop(state, steps, a, b, iters))
    res = H.compare([none, H.Contender(MEMORY, memory_tier), none], repeat, progress=progress)
    res.iters = iters
    return res


def pooled(r, key="steps"):                             # every step of every run of the row
    return [x for s in r.samples for x in s[key]]


def rate(r):
    return len(pooled(r)) / sum(pooled(r))


def overhead(args) -> str:
    res = measure(args.state_mib, args.step_ms, args.steps, args.repeat)

    def ms(r, q, key="steps"):
        return f"{1000 * H.pct(pooled(r, key), q):.1f}" if r.name == MEMORY or key == "steps" else "-"
    cols = [("steps/s", lambda r: f"{rate(r):.2f}"),
            ("throughput vs none", lambda r: f"{rate(r) / rate(res.rows[NONE]):.3f}"),
            ("step p50 ms", lambda r: ms(r, 50)), ("step p99 ms", lambda r: ms(r, 99)),
            ("stall in save p50 ms", lambda r: ms(r, 50, "stalls")), ("stall p99 ms", lambda r: ms(r, 99, "stalls"))]
    return "\n".join([
        f"(a) per-step save to the memory tier, {args.state_mib} MiB of state changing every step, "
        f"compute ~{args.step_ms:.0f} ms/step ({res.iters} matmuls 512x512, torch threads {torch.get_num_threads()}), "
        f"{args.steps} steps after 5 warm-up, {os.cpu_count()} cores; no checkpointing runs before and after",
        "", res.table(head="run", columns=cols)])


def curve(args) -> str:
    """(a) over state sizes x step times: one line per pair."""
    sizes = [int(x) for x in args.sizes.split(",")]
    steps_ms = [float(x) for x in args.steps_ms.split(",")]
    lines = [["state MiB", "step ms", "steps/s none", "steps/s memory", "throughput ratio", "stall p50 ms",
              "stall p99 ms", "step p50 ms none / memory", "CPU ms/step none / memory"]]
    for mib in sizes:
        for sm in steps_ms:
            steps = max(8, min(args.steps, round(args.curve_seconds * 1000 / sm)))
            res = measure(mib, sm, steps, args.repeat, progress=False)
            n, m = res.rows[NONE], res.rows[MEMORY]
            st = pooled(m, "stalls")
            lines.append([str(mib), f"{sm:.0f}", f"{rate(n):.2f}", f"{rate(m):.2f}", f"{rate(m) / rate(n):.3f}",
                          f"{1000 * H.pct(st, 50):.1f}", f"{1000 * H.pct(st, 99):.1f}",
                          f"{1000 * H.pct(pooled(n), 50):.0f} / {1000 * H.pct(pooled(m), 50):.0f}",
                          f"{1000 * n.median('cpu'):.0f} / {1000 * m.median('cpu'):.0f}"])
            print(" | ".join(lines[-1]), file=sys.stderr, flush=True)
    return "\n".join([
        f"(a) over sizes and step times: memory tier every step (state changing every step) vs no checkpointing; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores; ~{args.curve_seconds:.0f} s of steps per run "
        f"(at least 8, at most --steps), {args.repeat} repeat(s) alternated",
        "", C.align_table(lines)])


# -- (b) recovery -------------------------------------------------------------------------------------------------
class ByteProxy(CountingProxy):
    """tests/countproxy.CountingProxy (its request counting and pipe loop, reused as they are) that also counts
    ``down_bytes``: the bytes the object store answered with, i.e. written to the proxy's clients."""
    down_bytes = 0

    async def _handle(self, cr, cw):
        await super()._handle(cr, _CountingWriter(cw, self))


class _CountingWriter:
    """An asyncio StreamWriter that adds what is written through it to ``proxy.down_bytes``."""

    def __init__(self, writer, proxy: ByteProxy):
        self._w, self._proxy = writer, proxy

    def write(self, data: bytes) -> None:
        self._proxy.down_bytes += len(data)
        self._w.write(data)

    def __getattr__(self, name):
        return getattr(self._w, name)


def worker(args, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from ckptstore import Memory, Remote, Store
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
        out.update(resume_s=time.perf_counter() - t0, resumed=got, resumed_from=store.resumed_from)
        assert got == 1 and all(torch.equal(fresh["model"][k], state["model"][k]) for k in state["model"])
        assert torch.equal(fresh["own"], state["own"]), rank
    dist.barrier()
    store.close()
    return out


def lost_unique_bytes(root: Path, step: int, ranks) -> int:
    """Raw bytes of the distinct chunks (by id) of ``ranks``' manifests of ``step`` in the store root ``root``."""
    from ckptstore.format.manifest import decode_manifest
    seen = {}
    for r in ranks:
        p = root / "steps" / f"{step:012d}" / f"manifest-rank{r:05d}.msgpack"
        for ch in decode_manifest(p.read_bytes(), step=step, rank=r, what=str(p)).chunk_refs():
            seen[ch.blob_id] = ch.nbytes
    return sum(seen.values())


def recovery(args) -> str:
    from backends.launcher import S3Server
    base = Path(tempfile.mkdtemp(prefix="ckptstore-bench-rec-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptstore-bench-rec-", dir="/dev/shm"))
    res = H.Results()
    try:
        with S3Server() as server, ByteProxy(server.port) as proxy:
            url = server.new_bucket_url()
            so = json.dumps(dict(server.storage_options(), endpoint_url=proxy.endpoint))
            common = ["--base", base, "--shm", shm, "--remote", f"{url}/run", "--so", so, "--state-mib", args.state_mib]
            H.launch(4, __file__, "--worker", "save", *common, timeout=900)
            unique = lost_unique_bytes(shm / "mem0", 1, (2, 3))
            # the order is fixed: the second recovery loses what the first did, and more
            for name, gone in (("peers' memory", [shm / "mem1", base / "disk1"]),
                               ("remote (S3, moto)", [shm / "mem0", shm / "mem1", base / "disk1"])):
                for p in gone:
                    shutil.rmtree(p, ignore_errors=True)
                proxy.reset()
                b0, t0 = proxy.down_bytes, time.perf_counter()
                ranks = H.launch(4, __file__, "--worker", "resume", *common, timeout=900)
                res.add(name, max(r["resume_s"] for r in ranks), wall=time.perf_counter() - t0,
                        tiers="/".join(sorted({f'{r["resumed_from"]["tier"]}' for r in ranks})),
                        peer=sum(r["resumed_from"].get("peer_bytes", 0) or 0 for r in ranks),
                        s3_bytes=proxy.down_bytes - b0, gets=proxy.counts["GET"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    def last(key, fmt="{}"):
        return lambda r: fmt.format(r.samples[-1][key])
    cols = [("tiers (all ranks)", last("tiers")), ("job wall s", last("wall", "{:.1f}")),
            ("lost node's unique MiB", lambda r: f"{unique / MiB:.1f}"), ("MiB from peers", lambda r: f"{r.median('peer') / MiB:.1f}"),
            ("MiB answered by S3", lambda r: f"{r.median('s3_bytes') / MiB:.1f}"), ("S3 GETs (whole job)", last("gets"))]
    return "\n".join([
        f"(b) recovery after the loss of node 1 (ranks 2, 3) of 4 ranks as 2 nodes; per rank {args.state_mib} MiB "
        f"of data-parallel model bytes + 1 MiB of its own; {os.cpu_count()} cores",
        "", res.table(head="recovered from", unit="s (resume, slowest rank)", fmt="{:.2f}", columns=cols)])


def main():
    ap = H.parser(__doc__, repeat=1, scratch=False, seed=False)
    ap.add_argument("section", nargs="?", default="all", choices=["overhead", "curve", "recovery", "all"])
    ap.add_argument("--sizes", default="1,8,36,128", help="curve: state sizes, MiB")
    ap.add_argument("--steps-ms", default="50,130,500", help="curve: step times, ms")
    ap.add_argument("--curve-seconds", type=float, default=4.0, help="curve: seconds of steps per run")
    ap.add_argument("--state-mib", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-ms", type=float, default=50)
    for hidden in ("--worker", "--base", "--shm", "--remote", "--so"):   # the ranks of (b)
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return H.rank_main(lambda rank, world: worker(args, rank, world))
    out = {}
    if args.section in ("overhead", "all"):
        out["overhead"] = overhead(args)
    if args.section == "curve":
        out["curve"] = curve(args)
    if args.section in ("recovery", "all"):
        out["recovery"] = recovery(args)
    print("\n\n".join(out.values()))
    H.write_json(args.json, args, **out)


if __name__ == "__main__":
    main()
