"""The commit agreement at scale (issue 19), simulated: one real c10d TCPStore (libuv), one client connection and
one thread per simulated rank, ckptstore's own agreement code (tests/simranks.py). Rank 0 runs the save's commit
code (``ckptstore.commit.commit_across_ranks``) on the manifest of a Llama-shaped FSDP2 + AdamW state; the other
ranks send the parts that code computes for them (a sample of ranks computed from real manifests, checked
alike). Rank 0 starts once every other rank has sent its part, so its time is the agreement's own work.

Reports per N: rank 0's agreement time (gather read + fold + shard map + marker + verdict), the time until every
rank has its verdict, bytes each rank receives and sends, rank 0's gathered bytes and the Python memory it
allocated at peak during the agreement (tracemalloc, every thread counted: an upper bound), the largest
key-value store value, keys left in the store, the shard map's and commit marker's sizes, and the growth of
each from one N to the next.

    python benchmarks/bench_agreement.py                    # N = 64 256 1024 4096 10000, 7B shape
    python benchmarks/bench_agreement.py --n 256 1024 --shape 70b --roots 8

Times come from threads sharing the machine's cores with every simulated rank: upper bounds. Bytes, keys and
sizes are exact.
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024, 4096, 10000])
    ap.add_argument("--shape", default="7b", choices=["7b", "70b", "tiny"])
    ap.add_argument("--roots", type=int, default=0, help="ranks per node-local root (0: one shared root)")
    ap.add_argument("--saves", type=int, default=2, help="saves per N (the figures are the last one's)")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import threading
    threading.stack_size(512 << 10)
    from simranks import SimJob, summary

    rows = []
    for n in a.n:
        t = time.perf_counter()
        job = SimJob(n, shape=a.shape, ranks_per_root=a.roots, full=False, server_process=n > 2000)
        setup = time.perf_counter() - t
        try:
            before = job.keys()
            for step in range(1, a.saves + 1):
                job.precompute(step)
                gc.collect()
                tracemalloc.start()
                outs = job.save(step, timeout=600)
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            s = summary(outs)
            root = job.files[job.roots[0]]
            row = dict(n=n, shape=a.shape, roots=a.roots, committed=s["committed"],
                       rank0_s=round(s["rank0_seconds"], 3), all_done_s=round(s["all_done_seconds"], 3),
                       rx_other_B=s["max_received_other"], rx_leader_B=s["max_received_leader"],
                       tx_other_B=s["max_sent_other"], rank0_gathered_B=s["rank0_received"],
                       peak_alloc_MB=round(peak / 2**20, 1),
                       largest_value_B=max(c.largest_value for c in job.coords),
                       keys_left=job.keys() - before, map_B=len(root.get(f"{a.saves}/shards", b"")),
                       marker_B=len(root[f"{a.saves}/COMMIT"]), setup_s=round(setup, 1))
        finally:
            job.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\ngrowth from one N to the next (ratio of N in brackets):")
    for prev, cur in zip(rows, rows[1:]):
        f = cur["n"] / prev["n"]
        g = {k: round(cur[k] / prev[k], 2) for k in ("rank0_s", "all_done_s", "rx_other_B", "tx_other_B",
                                                   "rank0_gathered_B", "peak_alloc_MB", "map_B", "marker_B")
             if prev[k]}
        print(f"  {prev['n']} -> {cur['n']} [{f:.1f}x]: {g}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
