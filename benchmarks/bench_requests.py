#!/usr/bin/env python
"""Object-store requests per save and per resume, by kind (GET / HEAD / LIST / PUT / DELETE), at N ranks (issue 19).

    PYTHONPATH=$PWD python benchmarks/bench_requests.py                  # N = 4, 8, 16; node-local and shared
    PYTHONPATH=$PWD python benchmarks/bench_requests.py --ranks 4 --steps 3 --layout node --verbose
    PYTHONPATH=$PWD python benchmarks/bench_requests.py --ranks 4 --per-node 2 --layout node --state hsdp,ddp \
        --shared-kib 4200                                        # issue 29: PUTs per object name

Real processes (gloo on 127.0.0.1, launched like torchrun) run ``tests/request_worker.py``: a tiny state (1 KiB
new per rank per save, 64 KiB replicated on every rank), against one loopback moto S3 server, every request
counted by the proxy of ``tests/countproxy.py`` (real HTTP requests, by kind). Layouts: ``node``: node-local
roots of ``--per-node`` ranks each (rank 0's node uploader commits; the other nodes upload their parts);
``shared``: one root for every rank (rank 0 uploads everything).

Rows: ``save1`` is the job's first save (start-up included: lease, listing), ``save<k>`` a steady-state save
(k >= 2), ``resume`` a new job on empty local disks, from its start until every rank resumed (pulling the
newest step), ``resume+start`` until its uploaders' start-up work is done too. Counts are exact; with
``--repeat`` the configurations are measured again, alternated (LISTs of rank 0's wait rounds depend on timing).
``--state`` (the worker's: ``default``; ``ddp``: every rank the same values, saved without ``replicated=``;
``hsdp``: DTensors replicated over the nodes, sharded within them) and ``--shared-kib`` (the value every rank
holds, or each HSDP shard of it) pick the state; columns ``objPUT`` / ``max/name``: the uploads of blobs and
packs in that phase, and the most any one object name got (issue 29: 1, not one per node holding it).
"""
from __future__ import annotations

import sys
import tempfile

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)
from backends.launcher import S3Server  # noqa: E402
from countproxy import KINDS, CountingProxy, measure, object_puts  # noqa: E402


def main():
    ap = H.parser(__doc__, repeat=1, scratch=False, seed=False)
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", default="node,shared")
    ap.add_argument("--state", default="default", help="the worker's state(s): default, ddp, hsdp (comma list)")
    ap.add_argument("--shared-kib", type=int, default=64)
    ap.add_argument("--verbose", action="store_true", help="print every request of the last save and the resume")
    args = ap.parse_args()
    configs = [(layout, int(n), state) for state in args.state.split(",") for layout in args.layout.split(",")
               for n in args.ranks.split(",")]
    res = H.Results()
    with S3Server() as server, CountingProxy(server.port) as proxy:
        for _, (layout, n, state) in H.alternated(configs, args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                got = measure(proxy, f"s3://{server.create_bucket()}", server.storage_options(), tmp, n,
                              per_node=args.per_node, shared_root=layout == "shared", steps=args.steps,
                              shared_kib=args.shared_kib, state=state)
            where = f"N={n} {layout}" + (f" ({args.per_node} per node)" if layout == "node" else "") + \
                ("" if state == "default" else f" {state}")
            rows = [(f"save{k}", f"save{k}") for k in range(1, args.steps + 1)]
            for label, key in rows + [("resume", "resume"), ("resume+start", "resume_settled")]:
                puts = object_puts(got[f"requests_{key}"])
                res.add(f"{where}: {label}", None, total=sum(got[key].values()), **{k: got[key].get(k, 0) for k in KINDS},
                        objput=sum(puts.values()), maxname=max(puts.values(), default=0))
            print(f"{where}: resumed step {got['resumed_step']}", file=sys.stderr, flush=True)
            if args.verbose:
                for what in (f"save{args.steps}", "resume", "resume_settled"):
                    print(f"  -- requests of {where}: {what}")
                    for method, target in got[f"requests_{what}"]:
                        print("   ", method, target[:150])
    print("\n" + res.table(head="where: phase", key="total", unit="requests", fmt="{:.0f}",
                           columns=[(k, lambda r, k=k: f"{r.median(k):.0f}") for k in KINDS]
                           + [("objPUT", lambda r: f"{r.median('objput'):.0f}"),
                              ("max/name", lambda r: f"{r.median('maxname'):.0f}")]))
    H.write_json(args.json, args, rows=res.to_json(key="total"))


if __name__ == "__main__":
    main()
