#!/usr/bin/env python
"""Object-store requests per save and per resume, by kind (GET / HEAD / LIST / PUT / DELETE), at N ranks (issue 19).

    PYTHONPATH=$PWD python benchmarks/bench_requests.py                  # N = 4, 8, 16; node-local and shared
    PYTHONPATH=$PWD python benchmarks/bench_requests.py --ranks 4 --steps 3 --layout node --verbose

Real processes (gloo on 127.0.0.1, launched like torchrun) run ``tests/request_worker.py``: a tiny state (1 KiB
new per rank per save, 64 KiB replicated on every rank), against one loopback moto S3 server, every request
counted by the proxy of ``tests/countproxy.py`` (real HTTP requests, by kind). Layouts: ``node``: node-local
roots of ``--per-node`` ranks each (rank 0's node uploader commits; the other nodes upload their parts);
``shared``: one root for every rank (rank 0 uploads everything).

Rows: ``save1`` is the job's first save (start-up included: lease, listing), ``save<k>`` a steady-state save
(k >= 2), ``resume`` a new job on empty local disks, from its start until every rank resumed (pulling the
newest step), ``resume+start`` until its uploaders' start-up work is done too.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from backends.launcher import S3Server  # noqa: E402
from countproxy import KINDS, CountingProxy, measure  # noqa: E402


def row(name, counts):
    total = sum(counts.values())
    return f"  {name:<14}" + "".join(f"{counts.get(k, 0):>8}" for k in KINDS) + f"{total:>8}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", default="node,shared")
    ap.add_argument("--verbose", action="store_true", help="print every request of the last save and the resume")
    args = ap.parse_args()
    with S3Server() as server, CountingProxy(server.port) as proxy:
        for layout in args.layout.split(","):
            for n in (int(x) for x in args.ranks.split(",")):
                bucket = server.create_bucket()
                with tempfile.TemporaryDirectory() as tmp:
                    got = measure(proxy, f"s3://{bucket}", server.storage_options(), tmp, n,
                                  per_node=args.per_node, shared_root=layout == "shared", steps=args.steps)
                print(f"N={n} layout={layout} (per node {args.per_node})" if layout == "node" else
                      f"N={n} layout={layout}")
                print("  " + " " * 14 + "".join(f"{k:>8}" for k in KINDS) + f"{'total':>8}")
                for k in range(1, args.steps + 1):
                    print(row(f"save{k}", got[f"save{k}"]))
                print(row("resume", got["resume"]))
                print(row("resume+start", got["resume_settled"]))
                if args.verbose:
                    for what in (f"save{args.steps}", "resume", "resume_settled"):
                        print(f"  -- requests of {what}")
                        for method, target in got[f"requests_{what}"]:
                            print("   ", method, target[:150])
                sys.stdout.flush()


if __name__ == "__main__":
    main()
