"""The commit agreement at scale (issue 19), simulated: one real c10d TCPStore (libuv), one client connection and
one thread per simulated rank, ckptstore's own agreement code (tests/simranks.py). Rank 0 runs the save's commit
code (``ckptstore.distributed.commit.commit_across_ranks``) on the manifest of a Llama-shaped FSDP2 + AdamW state; the other
ranks send the parts that code computes for them (a sample of ranks computed from real manifests, checked
alike). Rank 0 starts once every other rank has sent its part, so its time is the agreement's own work.

Reports per N: rank 0's agreement time (gather read + fold + shard map + marker + verdict), the time until every
rank has its verdict, bytes each rank receives and sends, rank 0's gathered bytes and the Python memory it
allocated at peak during the agreement (tracemalloc, every thread counted: an upper bound; measured in a save
of its own, since tracing slows Python ~5x: times come from untraced saves), the largest
key-value store value, keys left in the store, the shard map's and commit marker's sizes, and the growth of
each from one N to the next.

    python benchmarks/bench_agreement.py                    # N = 64 256 1024 4096 10000, 7B shape
    python benchmarks/bench_agreement.py --n 256 1024 --shape 70b --roots 8

Times come from threads sharing the machine's cores with every simulated rank: upper bounds. Bytes, keys and
sizes are exact.
"""
from __future__ import annotations

import gc
import json
import resource
import sys
import time
import tracemalloc

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)


def resume_figures(job, step: int) -> dict:
    """The metadata a rank resuming ``step`` on N/2 ranks reads (marker + manifest table pages + shard map), the
    largest over a few ranks (tests/simranks.py ``SimJob.resume_reads``)."""
    got = [job.resume_reads(step, r, job.n // 2) for r in sorted({0, 1, job.n // 4, job.n // 2 - 1})]
    worst = max(got, key=lambda g: g["total_B"])
    return dict(resume_B=worst["total_B"], resume_rows_B=worst["rows_B"])


def rank0_only(n: int, shape: str, roots: int = 0, trace: bool = False) -> dict:
    """Rank 0's side alone at ``n`` ranks (more simulated ranks than this machine has sockets for): the other
    ranks' parts (computed as in tests/simranks.py) are put in the store by one client, then rank 0 runs the
    save's commit code and broadcasts its verdict; nobody reads it (its keys stay: not counted)."""
    import msgpack
    import torch.distributed as dist
    from ckptstore.distributed.commit import commit_across_ranks, root_identity
    from simranks import CountingCoordinator, SimJob, llama_manifest, _blob

    server = dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=True, wait_for_workers=False)
    job = SimJob.__new__(SimJob)                       # only its part arithmetic: no connection per rank
    job.n, job.shape, job.ranks_per_root, job.full, job.sample, job.files = n, shape, roots, False, 8, {}
    import numpy as np
    job.grid = np.arange(n, dtype="<i4").tobytes()
    job.roots = [job.root_of(r) for r in range(n)]
    job._parts = {}
    job.precompute(1)
    coord = CountingCoordinator(0, n, kv_store=server, instance=0)
    tag = coord.next_tag("save/1")
    keys = [f"ckptstore/0/{tag}/parts/p/{r}" for r in range(1, n)]
    vals = [msgpack.packb(job._parts[r], use_bin_type=True) for r in range(1, n)]
    for lo in range(0, len(keys), 1000):
        server.multi_set(keys[lo:lo + 1000], vals[lo:lo + 1000])
    del vals
    m = llama_manifest(shape, 0, n, job.grid, 1)
    new_commit, write_marker, write_map, write_rows = job._writers(0, 1)
    gc.collect()
    if trace:
        tracemalloc.start()
    t = time.perf_counter()
    ok = commit_across_ranks(coord, tag, 1, manifest=m, own_digest=(_blob("m")[:32].encode(), 4096, 0),
                             bytes_total=m.bytes_total, error=None,
                             where=root_identity(None) + job.roots[0].encode(), timeout=60,
                             new_commit=new_commit, write_marker=write_marker, write_map=write_map,
                             write_rows=write_rows, gen=0, adopt_run_id=lambda rid: None)
    secs = time.perf_counter() - t
    peak = None
    if trace:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    root = job.files[job.roots[0]]
    return dict(n=n, shape=shape, roots=roots, rank0_only=True, committed=ok, rank0_s=round(secs, 3),
                rank0_gathered_B=coord.bytes_received,
                peak_alloc_MB=None if peak is None else round(peak / 2**20, 1), largest_value_B=max(len(v) for v in [msgpack.packb(job._parts[1], use_bin_type=True)]),
                rx_leader_B=coord.largest_lead + 39 if roots else 0,      # its message + the verdict (39 B)
                map_B=len(root["1/shards"]), marker_B=len(root["1/COMMIT"]), **resume_figures(job, 1))


COLUMNS = [("all ranks s", "all_done_s"), ("rank sends / receives B", None), ("rank 0 gathers B", "rank0_gathered_B"),
           ("rank 0 peak alloc MB", "peak_alloc_MB"), ("largest value B", "largest_value_B"), ("keys left", "keys_left"),
           ("shard map B", "map_B"), ("commit marker B", "marker_B"), ("leader receives B", "rx_leader_B"),
           ("resume on N/2 reads B", "resume_B")]


def main() -> None:
    ap = H.parser(__doc__.splitlines()[0], repeat=None, scratch=False, seed=False)
    ap.add_argument("--n", type=int, nargs="*", default=[64, 256, 1024, 4096, 10000])
    ap.add_argument("--shape", default="7b", choices=["7b", "70b", "tiny"])
    ap.add_argument("--roots", type=int, default=0, help="ranks per node-local root (0: one shared root)")
    ap.add_argument("--saves", type=int, default=2, help="saves per N (the figures are the last one's)")
    ap.add_argument("--rank0-only", type=int, nargs="*", default=[],
                    help="also these N, rank 0's side alone (past the machine's socket limit)")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:                                  # two sockets per simulated rank (client and server side)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 16, 1 << 16))
    except (ValueError, OSError):        # not root: as many as allowed
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import threading
    threading.stack_size(512 << 10)
    from simranks import SimJob, summary

    res, rows = H.Results(), []
    for n in a.n:
        t = time.perf_counter()
        # past ~9,000 ranks the two sockets per rank pass a 20,000-file limit: the server then runs in a child
        job = SimJob(n, shape=a.shape, ranks_per_root=a.roots, full=False,
                     server_process=2 * n + 500 > resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        setup = time.perf_counter() - t
        try:
            before = job.keys()
            peak, timed = None, None
            for step in range(1, a.saves + 1):
                job.precompute(step)
                gc.collect()
                # tracemalloc slows Python ~5x (rank 0 at 10,000 ranks: 1.4 s traced, 0.22 s not): the last of
                # several saves is traced for the peak, the times are the previous save's (untraced)
                trace = step == a.saves and a.saves > 1
                if trace:
                    tracemalloc.start()
                outs = job.save(step, timeout=600)
                if trace:
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
                else:
                    timed = outs
            s = summary(timed)
            committed = min(s["committed"], summary(outs)["committed"])
            root = job.files[job.roots[0]]
            row = dict(n=n, shape=a.shape, roots=a.roots, committed=committed,
                       rank0_s=round(s["rank0_seconds"], 3), all_done_s=round(s["all_done_seconds"], 3),
                       rx_other_B=s["max_received_other"], rx_leader_B=s["max_received_leader"],
                       tx_other_B=s["max_sent_other"], rank0_gathered_B=s["rank0_received"],
                       peak_alloc_MB=None if peak is None else round(peak / 2**20, 1),
                       largest_value_B=max(c.largest_value for c in job.coords),
                       keys_left=job.keys() - before, map_B=len(root.get(f"{a.saves}/shards", b"")),
                       marker_B=len(root[f"{a.saves}/COMMIT"]), setup_s=round(setup, 1),
                       **resume_figures(job, a.saves))
        finally:
            job.close()
        rows.append(row)
        res.add(f"{n}", row["rank0_s"], **row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    for n in a.rank0_only:
        row = rank0_only(n, a.shape, a.roots)              # timed untraced; then once more for the peak
        row["peak_alloc_MB"] = rank0_only(n, a.shape, a.roots, trace=True)["peak_alloc_MB"]
        res.add(f"{n} (rank 0 alone)", row["rank0_s"], **row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    def cell(key):
        return lambda r: "-" if r.samples[-1].get(key) is None else f"{r.samples[-1][key]:,}"
    cols = [(h, cell(k) if k else lambda r: f"{r.samples[-1].get('tx_other_B', '-')} / {r.samples[-1].get('rx_other_B', '-')}")
            for h, k in COLUMNS]
    print(f"\nshape {a.shape}, {a.saves} saves per N (the last one's figures); {H.banner()}")
    print(res.table(head="N", unit="s (rank 0)", columns=cols))
    print("\ngrowth from one N to the next (ratio of N in brackets):")
    for prev, cur in zip(rows, rows[1:]):
        f = cur["n"] / prev["n"]
        g = {k: round(cur[k] / prev[k], 2) for k in ("rank0_s", "all_done_s", "rx_other_B", "tx_other_B",
                                                   "rank0_gathered_B", "peak_alloc_MB", "map_B", "marker_B")
             if prev[k]}
        print(f"  {prev['n']} -> {cur['n']} [{f:.1f}x]: {g}")
    H.write_json(a.json, a, rows=res.to_json())


if __name__ == "__main__":
    main()
