#!/usr/bin/env python
"""First-save benchmark (issue 28 goals 1-2: "from the first save on"): what a job's FIRST save blocks training
for, next to torch.save + fsync of the same state and to a steady save, in one run.

    python benchmarks/bench_first_save.py                     # 4000 small tensors (~33 MB), 5 repeats, ~1 min
    python benchmarks/bench_first_save.py --n-tensors 400 --max-bytes 1048576 --repeat 7 --json first.json

Contenders, alternated (each in a fresh folder; a fresh bucket on ONE moto S3 server on 127.0.0.1 for the
remote rows):
  * torch.save+fsync (the anchor): ``torch.save`` of the state, then fsync of the file.
  * first save, local: ``Store(new_root)`` then ``save(state, 1)`` (blocking); Store() not timed.
  * first save, remote: ``Store(new_root, remote=s3://fresh-bucket)`` with no s3fs client set up yet (as in a
    new job's process: s3fs's instance cache cleared), ``--gap`` seconds of "training" (a sleep), then
    ``save(state, 1)`` timed alone: the local commit, with the rewind check's listing of the remote (made in the
    background since the store opened, see README "Remote tier"); uploads are not timed.
  * steady save: into a store that holds step 1, every tensor changed (+1 in place), ``save(state, 2)``.
The state is ``--n-tensors`` fp32 tensors of seeded random sizes in [--min-bytes, --max-bytes].
"""
from __future__ import annotations

import time
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path; imports no ckptstore)
import common as C  # noqa: E402
import torch  # noqa: E402

ANCHOR = "torch.save+fsync"


def make_state(args) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = max(1, args.min_bytes // 4), max(1, args.max_bytes // 4)
    sizes = torch.randint(lo, hi + 1, (args.n_tensors,), generator=g).tolist()
    return {"model": {f"layer{i // 8}.w{i % 8}": torch.randn(n, generator=g) for i, n in enumerate(sizes)},
            "step": 1}


def main() -> None:
    ap = H.parser(__doc__, repeat=5)
    ap.add_argument("--n-tensors", type=int, default=4000)
    ap.add_argument("--min-bytes", type=int, default=64)
    ap.add_argument("--max-bytes", type=int, default=16384)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between Store() and the first save (remote)")
    args = ap.parse_args()
    from backends.launcher import S3Server
    from ckptstore import Remote, Store
    state = make_state(args)
    nbytes = sum(C.nbytes(t) for t in state["model"].values())
    base = H.scratch_dir(args.dir) / "first_save"
    base.mkdir(parents=True, exist_ok=True)
    print(H.banner(state=f"{len(state['model'])} fp32 tensors, {nbytes / C.MiB:.1f} MiB"))
    counter = iter(range(1 << 30))

    def fresh() -> Path:
        d = base / f"r{next(counter)}"
        C.rmtree(d)
        return d

    with S3Server() as server:
        opts = server.storage_options()

        def torch_save(d: Path):
            d.mkdir(parents=True)
            C.torch_save_fsync(state, d / "state.pt")

        def first_local(d: Path):
            store = Store(str(d))
            t = time.perf_counter()
            store.save(state, 1)
            secs = time.perf_counter() - t
            store.close()
            return {"seconds": secs}

        def first_remote(d: Path):
            url = server.new_bucket_url("first")
            import s3fs
            s3fs.S3FileSystem.clear_instance_cache()       # a new job's process: no client set up yet
            try:
                store = Store(str(d), remote=Remote(url), storage_options=opts)
                time.sleep(args.gap)
                t = time.perf_counter()
                store.save(state, 1)
                secs = time.perf_counter() - t
                store.close()
                return {"seconds": secs}
            finally:
                server.cleanup(url)

        def steady_setup():
            d = fresh()
            store = Store(str(d))
            store.save(state, 1)
            for t in state["model"].values():
                t.add_(1)
            return d, store

        def steady(ctx):
            _, store = ctx
            store.save(state, 2)

        def steady_teardown(ctx):
            d, store = ctx
            store.close()
            C.rmtree(d)

        def in_fresh(fn):
            return dict(setup=fresh, run=fn, teardown=C.rmtree)

        contenders = [H.Contender(ANCHOR, **in_fresh(torch_save)),
                      H.Contender("first save, local", **in_fresh(first_local)),
                      H.Contender(f"first save, remote (Store() {args.gap:g} s before)", **in_fresh(first_remote)),
                      H.Contender("steady save (every tensor changed)", run=steady, setup=steady_setup,
                                  teardown=steady_teardown)]
        res = H.compare(contenders, args.repeat, H.Results(ratios={"x torch": ANCHOR}))
    C.rmtree(base)
    print("\n" + res.table())
    H.write_json(args.json, args, state=dict(n_tensors=len(state["model"]), bytes=nbytes), rows=res.to_json())


if __name__ == "__main__":
    main()
