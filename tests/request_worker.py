"""One rank of a tiny job that saves to / resumes from a loopback S3 remote through the request-counting proxy
(tests/countproxy.py), launched like torchrun (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) by
tests/remote/test_request_budget.py and benchmarks/bench_requests.py.

``--store`` may hold ``{node}`` (= rank // ``--per-node``): node-local roots shared by the ranks of one "node".
State per rank: ``w`` (1 KiB, different on every rank and every step: new bytes at each save) and ``shared``
(the same ``--shared-kib`` KiB on every rank, never changing: data-parallel replicas of one value). Each rank
also keeps a ``step`` counter.

``--state ddp``: every value the same on every rank (data-parallel replicas saved without ``replicated=``: each
rank packs the same chunks into byte-identical packs). ``--state hsdp``: HSDP (issue 29): ``w`` and ``shared``
are DTensors on a (nodes, ``--per-node``) mesh, replicated over the nodes and sharded over the ranks of a node,
so the ranks of other nodes at the same place in theirs hold the same shards (same chunk ids, same packs).

``--diverge``: with hsdp, the nodes' replicas of ``w`` differ (each node adds its index): the shards the shard
map calls replicas are not the same bytes. Faults (the lifecycle tests): ``--node0-endpoint`` sends node 0's
requests to another endpoint (a fault proxy), ``--deadline`` bounds every remote call (seconds), ``--hold DIR``
makes the job wait after marking ``save<k>`` (k < ``--steps``) until ``DIR/go<k>`` exists, and
``--upload-errors`` reports a failed upload in the result (``upload_errors``) instead of failing the rank.

Modes: ``save``: resume, then save steps ``start+1 .. --steps``; after each save every rank waits for its
uploads, the ranks meet, and rank 0 marks ``save<step>`` on the proxy. ``resume``: resume (rank 0 marks
``resumed`` once every rank has), then wait for the uploader's start-up work and mark ``settled``. Rank 0
prints ``RESULT {...}`` with the step resumed.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from countproxy import mark  # noqa: E402

from ckptstore import Remote, RetryPolicy, Store, UploadError  # noqa: E402
from rank import finish, join, result  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["save", "resume"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--remote", required=True)
    ap.add_argument("--so", required=True, help="storage options (JSON); endpoint_url is the proxy's")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--shared-kib", type=int, default=64)
    ap.add_argument("--state", default="default", choices=["default", "ddp", "hsdp"])
    ap.add_argument("--diverge", action="store_true")
    ap.add_argument("--node0-endpoint", default=None)
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--hold", default=None)
    ap.add_argument("--upload-errors", action="store_true")
    args = ap.parse_args()
    rank, world = join()
    so = json.loads(args.so)
    endpoint = so["endpoint_url"]
    root = args.store.replace("{node}", str(rank // args.per_node)).replace("{rank}", str(rank))
    node = rank // args.per_node
    if args.node0_endpoint and node == 0:
        so = dict(so, endpoint_url=args.node0_endpoint)
    retry = RetryPolicy(deadline=args.deadline, op_timeout=args.deadline / 2) if args.deadline else RetryPolicy()
    store = Store(root, remote=Remote(args.remote, retry=retry), storage_options=so, collective_timeout=120)
    g = torch.Generator().manual_seed(1234)
    shared = torch.randn(args.shared_kib * 256, generator=g)
    # what tells the ranks' values apart: the rank; nothing (ddp); the rank's place in its node (hsdp's shard)
    place = {"default": rank, "ddp": 0, "hsdp": rank % args.per_node}[args.state]

    if args.state == "hsdp":                    # each place in a node its own shard of it
        shared = shared + place

    def w_of(step):
        return torch.full((256,), float(step * 1000 + place + (0.5 * node if args.diverge else 0)))
    if args.state == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        mesh = init_device_mesh("cpu", (world // args.per_node, args.per_node))

        def wrap(local):                        # this rank's shard of a (per_node x len(local),) tensor
            return DTensor.from_local(local.clone(), mesh, [Replicate(), Shard(0)], run_check=False)
        state = {"w": wrap(w_of(0)), "shared": wrap(shared), "step": 0}
    else:
        wrap = torch.Tensor.clone
        state = {"w": w_of(0), "shared": shared.clone(), "step": 0}

    def local(v):
        return v.to_local() if hasattr(v, "to_local") else v
    start = store.resume(state) or 0
    # every rank got its own values back (a failed check exits non-zero: the launcher raises)
    assert torch.equal(local(state["shared"]), shared), rank
    assert start == 0 or torch.equal(local(state["w"]), w_of(start)), rank
    out = {"rank": rank, "resumed": start, "tier": (store.resumed_from or {}).get("tier")}
    dist.barrier()
    if rank == 0:
        mark(endpoint, "resumed")
    errors = []

    def uploads():
        try:
            store.wait_for_uploads(120)
        except UploadError as e:
            if not args.upload_errors:
                raise
            errors.append(str(e))
    if args.mode == "resume":
        uploads()
        dist.barrier()
        if rank == 0:
            mark(endpoint, "settled")
    else:
        for step in range(start + 1, args.steps + 1):
            state["w"] = wrap(w_of(step))
            state["step"] = step
            store.save(state, step)
            uploads()
            dist.barrier()
            if rank == 0:
                mark(endpoint, f"save{step}")
            if args.hold and step < args.steps:
                while not os.path.exists(os.path.join(args.hold, f"go{step}")):
                    time.sleep(0.05)
                dist.barrier()
    if args.upload_errors:
        try:
            store.close()
        except UploadError as e:
            errors.append(str(e))
        out["upload_errors"] = errors
    else:
        store.close()
    result(out)
    finish()


if __name__ == "__main__":
    main()
