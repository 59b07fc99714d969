"""Read each byte once at resume (issue 19, ckptstore/fanout.py): chunk bytes read from storage per rank, and
resume time, before (every data-parallel rank reads all it needs) and after (each chunk every rank needs is read
by one rank and broadcast over gloo), for a DDP + AdamW job on 127.0.0.1.

Run by hand (not a test)::

    PYTHONPATH=$PWD python benchmarks/bench_read_once.py --mib 96 --ranks 2 4 [--s3]

Each configuration saves once (DDP, every rank the same tensors; ``--replicated`` saves them from rank 0 only),
then ONE job of the same ranks resumes twice: first with ``CKPTSTORE_READ_ONCE=0`` (before), then with it on
(after). Bytes are counted at the storage layer (every read of ``objects/`` / ``packs/``, see
tests/read_once_worker.py). ``local``: the store is a local directory, read hot from the page cache (the save
just wrote it): times there measure CPU and copies, not a disk. ``s3``: a moto server on 127.0.0.1; every rank
resumes with ``Store(read_only=True)`` from an empty local root, so it reads straight from the bucket.
Resume time is the slowest rank's ``store.resume`` (the job waits for it).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from dist import Job  # noqa: E402

WORKER = REPO / "tests" / "read_once_worker.py"
MiB = 1 << 20


def dim_for(mib: int) -> int:
    """Side of the extra square fp32 weight so that weight + AdamW's two moments are about ``mib`` MiB."""
    return max(64, int((mib * MiB / 12) ** 0.5))


def job(world, *args):
    return Job(world, *args, script=WORKER).check(600)


def main(argv=None):
    ap = argparse.ArgumentParser()
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
    rows = []
    server = None
    backends = ["local"] + (["s3"] if args.s3 else [])
    try:
        for backend in backends:
            for world in args.ranks:
                root = work / f"{backend}-{world}"
                shutil.rmtree(root, ignore_errors=True)
                if backend == "local":
                    job(world, "--mode", "save", "--store", str(root / "store"), *common)
                    load = ["--store", str(root / "store")]
                else:
                    if server is None:
                        from backends.launcher import S3Server
                        server = S3Server(workdir=work / "moto").start()
                    import json
                    url, so = server.new_bucket_url("readonce"), json.dumps(server.storage_options())
                    job(world, "--mode", "save", "--store", str(root / "save{rank}"), "--remote", url,
                        "--so", so, *common)
                    load = ["--store", str(root / "load{rank}"), "--remote", url, "--so", so, "--read-only", "1"]
                res = job(world, "--mode", "load", "--phases", "before,after", *load, *common)
                for label in ("before", "after"):
                    got = [res[r][label] for r in sorted(res)]
                    assert len({g["digest"] for g in got}) == 1 and {g["step"] for g in got} == {1}, got
                    group = max((g["resumed_from"].get("read_once") or {}).get("group_seconds", 0) for g in got)
                    rows.append((backend, world, label, [g["read"] for g in got], max(g["seconds"] for g in got),
                                 group))
    finally:
        if server is not None:
            server.stop()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nstate ~{args.mib} MiB (DDP + AdamW, fp32), chunk {args.chunk_mib} MiB, "
          f"{'replicated' if args.replicated else 'every rank saves the same tensors'}")
    print(f"{'backend':8} {'ranks':>5} {'':7} {'MiB read per rank':40} {'job total':>10} {'resume s':>9} "
          f"{'of which gloo group':>20}")
    for backend, world, label, reads, secs, group in rows:
        per = " ".join(f"{r / MiB:7.1f}" for r in reads)
        print(f"{backend:8} {world:5d} {label:7} {per:40} {sum(reads) / MiB:10.1f} {secs:9.3f} {group:20.3f}")


if __name__ == "__main__":
    main()
