#!/usr/bin/env python
"""Read each byte once at resume (issue 19, ckptstore/distributed/fanout.py): chunk bytes read from storage per rank, and
resume time, before (every data-parallel rank reads all it needs) and after (each chunk every rank needs is read
by one rank and broadcast over gloo), for a DDP + AdamW job on 127.0.0.1.

Run by hand (not a test)::

    PYTHONPATH=$PWD python benchmarks/bench_read_once.py --mib 96 --ranks 2 4 [--s3] [--repeat 3]

Each configuration saves once (DDP, every rank the same tensors; ``--replicated`` saves them from rank 0 only),
then, per repeat, ONE job of the same ranks resumes twice: with ``CKPTSTORE_READ_ONCE=0`` (before) and with it
on (after), the order alternated between repeats. Bytes are counted at the storage layer (every read of
``objects/`` / ``packs/``, see tests/read_once_worker.py). ``local``: the store is a local directory, read hot
from the page cache (the save just wrote it): times there measure CPU and copies, not a disk. ``s3``: a moto
server on 127.0.0.1; every rank resumes with ``Store(read_only=True)`` from an empty local root, so it reads
straight from the bucket. Resume time is the slowest rank's ``store.resume`` (the job waits for it).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)
import common as C  # noqa: E402

WORKER = H.REPO / "tests" / "read_once_worker.py"
MiB = C.MiB


def dim_for(mib: int) -> int:
    """Side of the extra square fp32 weight so that weight + AdamW's two moments are about ``mib`` MiB."""
    return max(64, int((mib * MiB / 12) ** 0.5))


def main(argv=None):
    ap = H.parser(__doc__, repeat=1, scratch=False)
    ap.add_argument("--mib", type=int, default=96, help="state size (weight + 2 AdamW moments), MiB")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--chunk-mib", type=int, default=8, help="Writing.chunk_size, MiB")
    ap.add_argument("--replicated", action="store_true", help="save(replicated=['app'])")
    ap.add_argument("--s3", action="store_true", help="also against a moto S3 server on 127.0.0.1")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_read_once_"))
    common = ["--dim", str(dim_for(args.mib)), "--chunk-mib", str(args.chunk_mib), "--steps", "1"]
    if args.replicated:
        common += ["--replicated", "app"]
    res, server = H.Results(), None
    try:
        for backend in ["local"] + (["s3"] if args.s3 else []):
            for world in args.ranks:
                root = work / f"{backend}-{world}"
                shutil.rmtree(root, ignore_errors=True)
                if backend == "local":
                    H.launch(world, WORKER, "--mode", "save", "--store", root / "store", *common, timeout=600)
                    load = ["--store", root / "store"]
                else:
                    if server is None:
                        from backends.launcher import S3Server
                        server = S3Server(workdir=work / "moto").start()
                    url, so = server.new_bucket_url("readonce"), json.dumps(server.storage_options())
                    H.launch(world, WORKER, "--mode", "save", "--store", root / "save{rank}", "--remote", url,
                             "--so", so, *common, timeout=600)
                    load = ["--store", root / "load{rank}", "--remote", url, "--so", so, "--read-only", "1"]
                for rep in range(args.repeat):
                    phases = H.order(["before", "after"], rep)
                    got = H.launch(world, WORKER, "--mode", "load", "--phases", ",".join(phases), *load, *common,
                                   timeout=600)
                    for label in phases:
                        ranks = [g[label] for g in got]
                        name = f"{backend} {world} ranks {label}"
                        res.check(name, len({g["digest"] for g in ranks}) == 1 and {g["step"] for g in ranks} == {1})
                        res.add(name, max(g["seconds"] for g in ranks), reads=[g["read"] for g in ranks],
                                group=max((g["resumed_from"].get("read_once") or {}).get("group_seconds", 0)
                                          for g in ranks))
    finally:
        if server is not None:
            server.stop()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nstate ~{args.mib} MiB (DDP + AdamW, fp32), chunk {args.chunk_mib} MiB, "
          f"{'replicated' if args.replicated else 'every rank saves the same tensors'}; median of {args.repeat}")
    before = {"x before": lambda r: r.name.replace(" after", " before") if r.name.endswith("after") else None}
    print(res.table(head="backend ranks phase", unit="s (resume)", ratios=before, columns=[
        ("MiB read per rank", lambda r: " ".join(f"{x / MiB:.1f}" for x in r.samples[-1]["reads"])),
        ("job total MiB", lambda r: f"{sum(r.samples[-1]['reads']) / MiB:.1f}"),
        ("of which gloo group s", lambda r: f"{r.median('group'):.3f}")]))
    H.write_json(args.json, args, rows=res.to_json(before))


if __name__ == "__main__":
    main()
