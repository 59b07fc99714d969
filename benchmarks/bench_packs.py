#!/usr/bin/env python
"""Many-small-tensors benchmark: ckptstore vs torch.save vs raw O_DIRECT I/O (and, with --remote, vs boto3
against a moto S3 server on 127.0.0.1), on ONE state, in one run.

    python benchmarks/bench_packs.py --state small --repeat 3 --remote      # ~33 MB in 4000 tensors
    python benchmarks/bench_packs.py --state gpt1gb --repeat 2 --json packs_1gb.json

States (--state):
  * small:  --n-tensors (4000) fp32 tensors of random sizes in [--min-bytes, --max-bytes] (64 B - 16 KiB),
            seeded, random values, laid out like a model: {"model": {"layer{i}.w{j}": tensor}} (~33 MB).
  * gpt1gb / gpt3gb: the GPT + AdamW state of common.py (sizes "1gb" / "3gb", as bench_save.py).

Contenders, alternated (see benchmarks/README.md, "bench_packs.py"):
  1. raw O_DIRECT write / read (bench_save.case_raw), torch.save + fsync / torch.load cold (bench_save.case_torch),
     ckptstore ``Store(root).save(state, 1)`` into a fresh store / ``Store(root).load(1)`` with a fresh Store,
     the store evicted from the page cache first.
  2. files per step: what one save leaves under objects/, packs/, steps/<step>/, with apparent and allocated bytes.
  3. --remote: ckptstore upload (save(), then wait_for_uploads() timed alone) vs boto3 ``upload_file`` of the
     torch.save file (one object); remote resume into an empty local root vs boto3 ``download_file`` (+
     torch.load). Requests are counted from moto's request log (every measurement gets a fresh bucket).
"""
from __future__ import annotations

import contextlib
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import torch  # noqa: E402
from bench_save import RAW_R, RAW_W, TORCH_COLD, TORCH_S, case_raw, case_torch  # noqa: E402

MiB, STEP = C.MiB, 1
CK_SAVE, CK_LOAD = "ckptstore save", "ckptstore load cold"
SAVES, LOADS = (RAW_W, TORCH_S, CK_SAVE), (RAW_R, TORCH_COLD, CK_LOAD)
RATIOS = {"x torch": lambda r: TORCH_S if r.name in SAVES else TORCH_COLD,
          "x raw": lambda r: RAW_W if r.name in SAVES else RAW_R}
UP = ("boto3 upload_file (1 object)", "ckptstore upload (wait_for_uploads)")
DOWN = ("boto3 download_file (1 object)", "boto3 download_file+torch.load", "ckptstore resume, empty local root")
REMOTE_RATIOS = {"x boto3": lambda r: UP[0] if r.name in UP else DOWN[0]}


class State:
    """The one state every contender saves, and the run's options: ``store_state`` is what Store.save gets,
    ``torch_obj()`` what torch.save gets, ``tensors()`` every tensor (raw I/O, fingerprint)."""
    all_loads = False

    def __init__(self, args):
        t0 = time.perf_counter()
        self.args, self.kind = args, args.state
        if args.state == "small":
            g = torch.Generator().manual_seed(args.seed)
            lo, hi = max(1, args.min_bytes // 4), max(1, args.max_bytes // 4)
            sizes = torch.randint(lo, hi + 1, (args.n_tensors,), generator=g).tolist()
            self.model_sd = {f"layer{k // args.per_layer}.w{k % args.per_layer}": torch.randn(n, generator=g)
                             for k, n in enumerate(sizes)}
            self.store_state: dict[str, Any] = {"model": self.model_sd}
            self.desc = f"{len(sizes)} fp32 tensors of {lo * 4}-{hi * 4} B (seed {args.seed}), {args.per_layer} per layer"
        else:
            size = {"gpt1gb": "1gb", "gpt3gb": "3gb"}[args.state]
            self.model, self.opt = C.build_state(size, seed=args.seed)
            self.store_state = {"model": self.model, "optimizer": self.opt}
            self.desc = f"GPT + AdamW (common.py size {size!r})"
        self.build_s = time.perf_counter() - t0
        ts = self.tensors()
        self.n_tensors, self.nbytes = len(ts), sum(C.nbytes(t) for t in ts)
        self.sizes = sorted(C.nbytes(t) for t in ts)
        self.ref = C.fingerprint(ts)
        self.base = H.scratch_dir(args.dir)
        self.direct = C.o_direct_supported(self.base)
        # the raw rows' staging buffer: 64 MiB as in bench_save.py, but no bigger than the state (a 64 MiB buffer
        # for a 33 MB state would time page faults on memory the write never uses)
        self.raw_block = min(args.raw_block_mib * MiB, C._round_up(self.nbytes))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.model_sd.values()) if self.kind == "small" else C.state_tensors(self.model, self.opt)

    def torch_obj(self) -> dict[str, Any]:
        return self.store_state if self.kind == "small" else {"model": self.model.state_dict(),
                                                              "optimizer": self.opt.state_dict()}

    def timed(self, res: H.Results, name: str):
        return res.timed(name)

    def check(self, res: H.Results, name: str, obj: Any) -> None:
        if self.args.verify and res.first and res.row(name).samples:
            res.check(name, C.fingerprint(C.tree_tensors(obj)) == self.ref)

    def resume_like(self) -> tuple[dict[str, Any], Any]:
        """(what resume loads into, a context): small: empty tensors (resume replaces plain entries); gpt: the
        live model and optimizer, one byte of each tensor flipped meanwhile (resume must write it back)."""
        if self.kind == "small":
            return {"model": {k: torch.empty_like(t) for k, t in self.model_sd.items()}}, contextlib.nullcontext()
        return self.store_state, C.perturbed(self.tensors())

    def resumed(self, like: dict[str, Any]) -> Any:
        return like if self.kind == "small" else self.tensors()


def case_ckptstore(res: H.Results, st: State, d: Path, writing=None, rows=(CK_SAVE, CK_LOAD)) -> None:
    """``Store(root).save(state, 1)`` into a fresh store (construction not timed; ``files`` = what it left,
    by area), then, evicted, ``Store(root).load(1)`` with a fresh Store (construction timed). Also
    bench_pack_threshold's, with ``writing=Writing(packing=...)``."""
    from ckptstore import Store
    root = d / "store"
    with Store(str(root), **({"writing": writing} if writing else {})) as store:
        with res.timed(rows[0]) as m:
            r = store.save(st.store_state, STEP)
    files = C.count_files(root, STEP)
    m.update(disk=files["total"]["bytes"], files=files, phases=getattr(r, "phases", None),
             note=f"{C.result_note(r)}; {files['total']['files']} files")
    C.evict(root)
    with res.timed(rows[1]) as m:
        t0 = time.perf_counter()
        store = Store(str(root))                      # cold: a fresh Store, as in a new process
        m["store_open"] = time.perf_counter() - t0
        with store:
            out = store.load(STEP, map_location="cpu")
    m["note"] = f"incl. Store() {m['store_open'] * 1e3:.0f} ms"
    st.check(res, rows[1], out)


# --------------------------------------------------------------------------- remote (moto)


class Remote:
    """One moto server for the run; every measurement gets a fresh bucket. Requests are counted from moto's
    request log, CPU from /proc."""

    def __init__(self, st: State, run_dir: Path):
        from backends.launcher import S3Server
        self.st, self.args = st, st.args
        self.server = S3Server(workdir=run_dir / "moto").start()        # 127.0.0.1, free port
        self.opts, self.run_dir = self.server.storage_options(), run_dir
        self.torch_file = run_dir / "ckpt.pt"     # the baseline object: the torch.save file, written once
        C.torch_save_fsync(st.torch_obj(), self.torch_file)

    def requests_since(self, offset: int, bucket: str) -> dict[str, int]:
        """Requests moto logged for ``bucket`` since ``offset``, by method (+ status >= 400 as 'METHOD 404').
        werkzeug logs a request after answering it: wait until the count is stable (not timed)."""
        pat = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) /' + re.escape(bucket) + r'[/? ][^"]*" (\d{3})')
        last, stable_since, deadline = None, time.perf_counter(), time.perf_counter() + 3.0
        while True:
            with open(self.server.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
            ops: Counter[str] = Counter()
            for m in pat.finditer(text):
                ops[m.group(1)] += 1
                if int(m.group(2)) >= 400:
                    ops[f"{m.group(1)} {m.group(2)}"] += 1
            total, now = sum(v for k, v in ops.items() if " " not in k), time.perf_counter()
            if total != last:
                last, stable_since = total, now
            elif now - stable_since >= 0.3 or now > deadline:
                return {"total": total, **dict(sorted(ops.items()))}
            time.sleep(0.1)

    @contextlib.contextmanager
    def counted(self, bucket: str):
        """The yielded dict gets ``requests`` (moto's log), ``moto_cpu`` and ``client_cpu`` of the block."""
        off = self.server.log_path.stat().st_size
        with C.cpu_seconds(self.server.pids()) as out:
            yield out
        out["requests"] = self.requests_since(off, bucket)

    def listing(self, bucket: str, prefix: str) -> dict[str, Any]:
        """Objects under ``prefix/`` by first path component (objects, packs, steps, ...)."""
        areas: Counter[str] = Counter()
        n = size = 0
        for page in self.server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for o in page.get("Contents", []):
                n, size = n + 1, size + o["Size"]
                areas[o["Key"][len(prefix) + 1:].split("/", 1)[0]] += 1
        return {"objects": n, "bytes": size, "by_area": dict(sorted(areas.items()))}

    def ckptstore(self, res: H.Results, _ctx: Any = None) -> None:
        from ckptstore import Store
        url = self.server.new_bucket_url("packs")
        bucket, remote = url.split("://", 1)[1], f"{url}/ckpt"
        local, empty = C.fresh_dir(self.run_dir, "up-"), C.fresh_dir(self.run_dir, "resume-")
        try:
            with Store(str(local), remote=remote, storage_options=self.opts) as store:
                store.wait_for_uploads()                  # uploader up, remote listed (not timed)
                with self.counted(bucket) as cnt:
                    t0 = time.perf_counter()
                    r = store.save(self.st.store_state, STEP)
                    local_save = time.perf_counter() - t0
                    with res.timed(UP[1]) as m:
                        store.wait_for_uploads()
            lst = self.listing(bucket, "ckpt")
            m.update(cnt, disk=lst["bytes"], local_save=local_save, remote=lst, bytes_written=r.bytes_written,
                     note=f"local save {local_save:.2f} s (not counted); {lst['objects']} objects, "
                          f"{cnt['requests']['total']} requests")
            import s3fs
            s3fs.S3FileSystem.clear_instance_cache()     # no fs (listing cache, connections) from the upload
            # a fresh client, connected but not timed, as the boto3 rows' client is
            t_client = time.perf_counter()
            s3fs.S3FileSystem(**self.opts).call_s3("head_bucket", Bucket=bucket)
            t_client = time.perf_counter() - t_client
            like, guard = self.st.resume_like()
            with guard:
                with self.counted(bucket) as cnt:
                    with res.timed(DOWN[2]) as m:
                        t0 = time.perf_counter()
                        with Store(str(empty), remote=remote, storage_options=self.opts) as store:
                            step = store.resume(like)
                            m["seconds"] = time.perf_counter() - t0      # Store() + resume, not its close
                            tier = (store.resumed_from or {}).get("tier")
                res.check(DOWN[2], step == STEP)
                self.st.check(res, DOWN[2], self.st.resumed(like))
            pulled = C.count_files(empty, STEP)["total"]
            m.update(cnt, disk=pulled["bytes"], pulled=pulled, step=step, client_setup=t_client,
                     note=f"{cnt['requests']['total']} requests; pulled {pulled['files']} files; tier {tier}; "
                          f"client set-up {t_client:.2f} s (not counted)")
        finally:
            self.server.cleanup(url)
            C.rmtree(local)
            C.rmtree(empty)

    def boto3(self, res: H.Results, _ctx: Any = None) -> None:
        from boto3.s3.transfer import TransferConfig
        a = self.args
        url = self.server.new_bucket_url("packs-boto")
        bucket, key, dl = url.split("://", 1)[1], "ckpt.pt", self.run_dir / "download.pt"
        client = C.boto3_client(self.server, a.boto_concurrency)
        cfg = TransferConfig(max_concurrency=a.boto_concurrency, multipart_chunksize=a.boto_chunk_mb * MiB)
        try:
            client.head_bucket(Bucket=bucket)             # connect (not timed)
            C.evict(self.torch_file)
            with self.counted(bucket) as cnt, res.timed(UP[0]) as m:
                client.upload_file(str(self.torch_file), bucket, key, Config=cfg)
            m.update(cnt, disk=self.torch_file.stat().st_size, note=f"TransferConfig(max_concurrency="
                     f"{a.boto_concurrency}, multipart_chunksize={a.boto_chunk_mb} MiB)")
            with self.counted(bucket) as cnt, res.timed(DOWN[0]) as m:
                client.download_file(bucket, key, str(dl), Config=cfg)
            m.update(cnt, disk=dl.stat().st_size, note="no fsync")
            with res.timed(DOWN[1]) as m2:
                sd = torch.load(dl, weights_only=True, map_location="cpu")
            m2["torch_load"] = m2["seconds"]
            m2.update(seconds=m["seconds"] + m2["seconds"],
                      note=f"download, then torch.load {m2['torch_load']:.3f} s (from the page cache)")
            self.st.check(res, DOWN[1], sd)
        finally:
            dl.unlink(missing_ok=True)
            self.server.cleanup(url)
            client.close()


# --------------------------------------------------------------------------- main


def add_state_args(ap) -> None:
    """--state and its small-state options (also bench_pack_threshold's)."""
    ap.add_argument("--state", choices=("small", "gpt1gb", "gpt3gb"), default="small")
    ap.add_argument("--n-tensors", type=int, default=4000, help="small state: number of tensors")
    ap.add_argument("--min-bytes", type=int, default=64, help="small state: smallest tensor")
    ap.add_argument("--max-bytes", type=int, default=16384, help="small state: largest tensor")
    ap.add_argument("--per-layer", type=int, default=8, help="small state: tensors per 'layer{i}'")
    ap.add_argument("--raw-block-mib", type=int, default=64,
                    help="raw rows: O_DIRECT staging buffer, MiB (capped at the state size)")


def state_line(st: State) -> str:
    return (f"state: {st.kind}: {st.desc}; {C.gb(st.nbytes)} ({st.nbytes / MiB:.1f} MiB) in {st.n_tensors} tensors "
            f"(median {st.sizes[len(st.sizes) // 2]} B, {st.sizes[0]}-{st.sizes[-1]} B), built in {st.build_s:.1f} s")


def render_files(res: H.Results) -> str:
    lines = [["method", "area", "files", "dirs", "bytes", "allocated"]]
    ck = res.rows[CK_SAVE].samples[0].get("files") if res.rows[CK_SAVE].samples else None
    for area, rec in (ck or {}).items():
        lines.append(["ckptstore", area, rec["files"], rec["dirs"], C.fmt_bytes(rec["bytes"]),
                      C.fmt_bytes(rec["allocated"])])
    for name, row in (("torch.save", TORCH_S), ("raw", RAW_W)):
        s = res.rows[row].samples
        if s:
            lines.append([name, "(one file)", 1, 0, C.fmt_bytes(s[0]["disk"]), C.fmt_bytes(s[0]["allocated"])])
    return C.align_table(lines)


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, repeat=3, verify=True)
    add_state_args(ap)
    ap.add_argument("--remote", action="store_true", help="also measure upload / remote resume against moto S3")
    ap.add_argument("--remote-repeat", type=int, default=None,
                    help="run the remote part in the first N repeats only (default: every repeat)")
    ap.add_argument("--boto-concurrency", type=int, default=8, help="boto3 TransferConfig max_concurrency")
    ap.add_argument("--boto-chunk-mb", type=int, default=64, help="boto3 TransferConfig multipart_chunksize")
    args = ap.parse_args(argv)
    if args.remote_repeat is None:
        args.remote_repeat = args.repeat
    st = State(args)
    print(H.banner())
    print(state_line(st))
    run_dir = C.fresh_dir(st.base, "bench-packs-")
    print(f"dir: {run_dir} ({C.fs_type(run_dir)}), O_DIRECT {'yes' if st.direct else 'NO (buffered + fsync)'}; "
          f"repeat={args.repeat}, remote={'%d repeat(s)' % args.remote_repeat if args.remote else 'off'}, "
          f"verify={'first run' if args.verify else 'off'}", flush=True)

    def local(name, fn, rows):
        return H.Contender(name, lambda res, d: fn(res, st, d), records=True, rows=rows,
                           setup=lambda: C.fresh_dir(run_dir, "local-"), teardown=C.rmtree)
    contenders = [local("raw", case_raw, (RAW_W, RAW_R)), local("torch", case_torch, (TORCH_S, TORCH_COLD)),
                  local("ckptstore", case_ckptstore, (CK_SAVE, CK_LOAD))]
    res = H.Results().declare(*SAVES, group="save").declare(*LOADS, group="load")
    remote = None
    t_all = time.perf_counter()
    try:
        if args.remote:
            remote = Remote(st, run_dir)
            print(f"moto at {remote.server.endpoint} (TMPDIR on {C.fs_type(remote.server.workdir / 'tmp')})",
                  file=sys.stderr)

            def only_first(fn):                       # the remote part in the first --remote-repeat repeats
                return lambda res, ctx: fn(res) if res.rep < args.remote_repeat else None
            res.declare(*UP, *DOWN, group="remote")
            contenders += [H.Contender("remote ckptstore", only_first(remote.ckptstore), records=True,
                                       rows=(UP[1], DOWN[2])),
                           H.Contender("remote boto3", only_first(remote.boto3), records=True, rows=(UP[0], *DOWN[:2]))]
        H.compare(contenders, args.repeat, res)
    finally:
        if remote is not None:
            remote.server.stop()
        C.rmtree(run_dir)
    t_all = time.perf_counter() - t_all
    rate = [("GB/s", lambda r: f"{st.nbytes / r.median() / 1e9:.2f}" if r.median() else "n/a"),
            ("on disk", lambda r: C.fmt_bytes(r.median("disk")) if r.values("disk") else "")]
    print("\n" + res.table(ratios=RATIOS, columns=rate, rows=SAVES + LOADS))
    print(f"\nGB/s = {C.gb(st.nbytes)} of tensor bytes / median s; x torch / x raw = median / median of "
          "torch.save+fsync (torch.load cold) and raw write (raw read) (>1 = slower). Cold = evicted from the "
          "page cache (posix_fadvise; dentries/inodes stay cached). ckptstore load includes Store().")
    print("\nFiles left by one save (fresh store):\n" + render_files(res))
    if args.remote:
        print(f"\nRemote: moto S3 on 127.0.0.1, median of {min(args.repeat, args.remote_repeat)}; MiB/s = state "
              "bytes / median s; x boto3 = median / the boto3 row of the same direction; requests = moto's log "
              "for the bucket; moto cpu = s of CPU of the moto process.")
        cols = [("MiB/s", lambda r: f"{st.nbytes / MiB / r.median():.1f}" if r.median() else "n/a"),
                ("requests", lambda r: f"{H.med(s['requests']['total'] for s in r.samples if 'requests' in s) or 0:.0f}"
                 if any("requests" in s for s in r.samples) else ""),
                ("moto cpu", lambda r: f"{H.med(r.values('moto_cpu')):.1f}" if r.values("moto_cpu") else ""),
                ("local save s", lambda r: f"{r.median('local_save'):.2f}" if r.values("local_save") else "")]
        print(res.table(ratios=REMOTE_RATIOS, columns=cols, rows=UP + DOWN, head="row"))
        for name in (UP[1], DOWN[2]):
            s = res.rows[name].samples
            if s and "requests" in s[0]:
                print(f"{name}: requests {s[0]['requests']}" + (f"; remote objects of one step {s[0]['remote']}"
                                                                 if "remote" in s[0] else ""))
    print(f"\ntotal {t_all:.0f} s")
    H.write_json(args.json, args, state=dict(kind=st.kind, desc=st.desc, bytes=st.nbytes, n_tensors=st.n_tensors,
                                             min_tensor=st.sizes[0], max_tensor=st.sizes[-1]),
                 o_direct=st.direct, rows=res.to_json({**RATIOS, **REMOTE_RATIOS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
